"""dsv4: a JAX/Flax inference engine for DeepSeek-V4 models, built for long-prompt time to first token."""

from dsv4.api import init_random, load, num_params
from dsv4.config import Config
from dsv4.engine import LLM, RequestOutput
from dsv4.model import DeepseekV4

__all__ = ["LLM", "Config", "DeepseekV4", "RequestOutput", "init_random", "load", "num_params"]
__version__ = "0.1.0"
