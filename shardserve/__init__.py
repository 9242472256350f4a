"""shardserve: a distributed tensor-parallel LLM inference cluster.

    from shardserve import LLM, SamplingParams
    llm = LLM()  # the default model, SmolLM2-135M-Instruct
    print(llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text)
"""

from importlib.metadata import PackageNotFoundError, version

from shardserve.cluster.outputs import RequestOutput
from shardserve.cluster.sampling_params import SamplingParams
from shardserve.cluster.structured_outputs import StructuredOutputsParams

try:
    __version__ = version("shardserve")
except PackageNotFoundError:  # a source tree on sys.path without an installed distribution
    __version__ = "0+unknown"


def __getattr__(name: str):
    # LLM pulls in torch and the engine: import it only when asked for, so `shardserve.client` stays light.
    if name == "LLM":
        from shardserve.api.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "__version__"]
