"""kvserve: a KV-cache-centric LLM inference engine."""
from kvserve.llm import LLM
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling import Logprob, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
