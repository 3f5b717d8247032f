import os
import shutil
import sys
import tempfile

# What leapdecode makes on a machine (cache.py: training runs, token caches, the demo's
# fallback pair, ...) goes to a folder of this session's, never the user's
# ~/.cache/leapdecode. Set before leapdecode is imported: some modules read it once.
CACHE = tempfile.mkdtemp(prefix="leapdecode-test-cache-")
os.environ["LEAPDECODE_CACHE"] = CACHE
# ... except the compiled graphs (inductor) and the C++ attention kernel (extensions): built
# afresh each session they cost test_compiled.py 40 s to 2.5 min more (the kernel alone about
# 45 s), so they persist in a test-only folder (not the user's home), shared by sessions.
BUILDS = os.environ.get("LEAPDECODE_TEST_BUILD_CACHE") or os.path.join(
    tempfile.gettempdir(), "leapdecode-test-cache"
)
for name in ("inductor", "extensions"):
    os.makedirs(os.path.join(BUILDS, name), exist_ok=True)
    os.symlink(os.path.join(BUILDS, name), os.path.join(CACHE, name))
# torch picks its inductor folder once, at its first compile (compiled.py only sets a default)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(BUILDS, "inductor")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import helpers  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tokenizer"))
    helpers.make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory, tok_dir):
    path = str(tmp_path_factory.mktemp("target"))
    helpers.make_llama(path, seed=0, tokenizer_dir=tok_dir)
    return path


@pytest.fixture(scope="session")
def hf_target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir).eval()


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory, hf_target, tok_dir):
    path = str(tmp_path_factory.mktemp("draft"))
    helpers.make_noisy_copy(hf_target, path, noise=0.02, seed=1, tokenizer_dir=tok_dir)
    return path


@pytest.fixture(scope="session")
def decoder(target_dir, draft_dir):
    from leapdecode import LeapDecoder

    return LeapDecoder.from_pretrained(target_dir, draft=draft_dir)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CACHE, ignore_errors=True)  # (the symlinks only: the builds stay)
