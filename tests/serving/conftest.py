"""Fixtures of the serving tests: a random tiny llada2_moe with a character tokenizer, a slowed-down executor, and
servers on ephemeral 127.0.0.1 ports (uvicorn in a thread). Every server test is bounded in time and count."""
import contextlib
import threading
import time

import pytest
import torch

from dblock.decoding.params import DecodeConfig
from dblock.forward import Forward

DEC = DecodeConfig(max_new_tokens=16)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A random tiny llada2_moe (vocab 96, block 8) with the character tokenizer's tokenizer.json beside it."""
    from dblock.tasks import CharTokenizer
    from dblock.tiny import make_tiny
    d = str(tmp_path_factory.mktemp("serving") / "tiny")
    make_tiny("llada2_moe", d, seed=0)
    CharTokenizer().save(d)
    return d


@pytest.fixture(scope="session")
def model(model_dir):
    import dblock
    return dblock.load(model_dir, dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(model):
    from dblock.prompts import load_tokenizer
    return load_tokenizer(model)


def make_forward(model, executor: str):
    from dblock.optimized.executor import epoch_forward
    from dblock.decoding.generate import reference_forward
    return reference_forward(model) if executor == "reference" else epoch_forward(model)


class SlowForward(Forward):
    """Delegates to an executor and sleeps `delay` seconds per denoising pass (to hold requests in flight); records
    end_request calls; `fail_next` makes the next denoise raise."""

    def __init__(self, inner, delay: float = 0.0):
        self.inner, self.config, self.name, self.delay = inner, inner.config, inner.name, delay
        self.ended: list = []
        self.fail_next = False

    def new_cache(self):
        return self.inner.new_cache()

    def append(self, items):
        return self.inner.append(items)

    def denoise(self, items):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected executor failure")
        if self.delay:
            time.sleep(self.delay)
        return self.inner.denoise(items)

    def end_block(self, request, block):
        return self.inner.end_block(request, block)

    def end_request(self, request):
        self.ended.append(request)
        return self.inner.end_request(request)

    def last_pass_stats(self):
        return self.inner.last_pass_stats() if hasattr(self.inner, "last_pass_stats") else {}

    def stats(self):
        return self.inner.stats() if hasattr(self.inner, "stats") else {}


def offline(model, executor, schedule, prompt, max_tokens, seed=0, dec=DEC):
    from dblock.decoding.generate import generate
    res = generate(make_forward(model, executor), [list(prompt)], dec.replace(max_new_tokens=max_tokens), schedule,
                   seeds=[seed])
    return res.tokens[0]


@contextlib.contextmanager
def running_server(model, tokenizer=None, executor="reference", schedule="native", delay=0.0, api_key=None,
                   limits=None, dec=DEC, chat_template=None, **engine_kw):
    """(ServerThread, Engine, forward) for the duration of the block; stopped gracefully afterwards."""
    from dblock.serving.engine import Engine, EngineConfig
    from dblock.serving.server import ServerThread, create_app
    fwd = SlowForward(make_forward(model, executor), delay)
    engine = Engine(fwd, schedule, dec, EngineConfig(**engine_kw))
    app = create_app(engine, tokenizer=tokenizer, model_name="tiny", limits=limits, api_key=api_key,
                     drain_timeout=30, poll_s=0.05, chat_template=chat_template)
    srv = ServerThread(app).start()
    try:
        yield srv, engine, fwd
    finally:
        assert srv.stop(timeout=30), "server did not stop within 30 s"


def wait_until(pred, timeout=10.0, every=0.01):
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(every)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield
    # no server or engine thread may outlive a test
    left = [t.name for t in threading.enumerate() if t.name in ("dblock-engine", "dblock-uvicorn") and t.is_alive()]
    assert not left, f"threads left running: {left}"
