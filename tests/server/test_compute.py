"""The server's compute thread: every model pass a server runs happens on it, and the threads that
serve requests run their own torch operations without an OpenMP team (see
``specdec.server.compute``: each extra team slows every parallel region of a pass down)."""

from __future__ import annotations

import io
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient

from specdec.drafters import ModelDrafter
from specdec.models.toy import ToyLM
from specdec.server import ServerSettings, create_app
from specdec.server import command
from specdec.server import compute as compute_mod
from specdec.server.compute import COMPUTE, ComputeThread, one_openmp_thread
from specdec.server.scheduler import BatchedModel, Scheduler
from specdec.server.sessions import SerializedModel

from .test_scheduler import _hammer, _Letters


class _Threads(ToyLM):
    """A toy whose passes (forward, batched forward, token tree) record the thread running them."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seen: list[tuple[str, threading.Thread]] = []

    def forward(self, tokens, cache, *, last_only=False):
        self.seen.append(("forward", threading.current_thread()))
        return super().forward(tokens, cache, last_only=last_only)

    def forward_batch(self, items):
        self.seen.append(("batch", threading.current_thread()))
        return [ToyLM.forward(self, t, c, last_only=last) for t, c, last in items]

    def forward_tree(self, tokens, parents, cache, *, prefix=None):
        self.seen.append(("tree", threading.current_thread()))
        return super().forward_tree(tokens, parents, cache, prefix=prefix)


def test_every_pass_of_the_wrappers_runs_on_the_compute_thread(two_threads):
    """Batched passes of two models, token trees between batches and lock-serialised passes,
    asked for from eight threads at once, all run on the one compute thread; the asking threads
    end up with one OpenMP thread each, and the main thread keeps its own count."""
    target, draft, other = _Threads(6, order=2, seed=0), _Threads(6, order=1, seed=1), _Threads(6, order=1, seed=2)
    served_target = BatchedModel(target, Scheduler(target))
    served_draft = BatchedModel(draft, Scheduler(draft, name="draft"))
    serialised = SerializedModel(other)
    counts: list[int] = []

    def chain(model):
        def job() -> None:
            cache = model.new_cache(64)
            model.forward(torch.tensor([1, 2, 3]), cache)
            model.forward(torch.tensor([4]), cache)
            counts.append(torch.get_num_threads())
        return job

    def tree() -> None:
        cache = served_target.new_cache(64)
        served_target.forward(torch.tensor([1, 2]), cache)
        served_target.forward_tree(torch.tensor([0, 1, 2]), torch.tensor([-1, -1, 0]), cache)
        counts.append(torch.get_num_threads())

    _hammer([chain(served_target), chain(served_target), chain(served_draft), chain(served_draft), tree, tree,
                 chain(serialised), chain(serialised)])
    seen = target.seen + draft.seen + other.seen
    assert {kind for kind, _ in target.seen} >= {"forward", "tree"} and draft.seen and other.seen
    assert {thread for _, thread in seen} == {COMPUTE._thread}
    assert counts and set(counts) == {1}
    assert torch.get_num_threads() == 2


def test_a_servers_passes_run_on_the_compute_thread():
    """Through the app: edge sessions' rounds and OpenAI completions drafted on the server, the
    draft model wrapped as ``specdec serve`` wraps it."""
    target, draft = _Threads(6, order=2, seed=0), _Threads(6, order=1, seed=1)
    engine = SimpleNamespace(drafter=object(), draft_model=SimpleNamespace(model=draft))
    served_draft = command.draft_server_model(engine, batching=True)
    app = create_app(target, tokenizer=_Letters(), settings=ServerSettings(),
                     drafter_factory=lambda: ModelDrafter(served_draft), drafter_name="toy", draft_model=served_draft)
    client = TestClient(app, base_url="http://localhost")
    executor_threads = app.state.ctx.executor.submit(torch.get_num_threads).result()

    def session() -> None:
        sid = client.post("/v1/sessions", json={"prompt_ids": [1, 2, 3], "temperature": 0.0}).json()["session_id"]
        assert client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1, 2]}).status_code == 200

    def completion() -> None:
        r = client.post("/v1/completions", json={"model": "target", "prompt": "abc", "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text

    _hammer([session, session, completion, completion], rounds=3)
    assert target.seen and draft.seen
    assert {thread for _, thread in target.seen + draft.seen} == {COMPUTE._thread}
    assert executor_threads == 1


def test_serve_loads_the_models_on_the_compute_thread(monkeypatch):
    """``specdec serve`` builds everything on the compute thread (a team made while loading on the
    main thread would stay for the process's life); a failure there reaches the caller."""
    from specdec import engine as engine_mod

    where: list[threading.Thread] = []

    class Stop(Exception):
        pass

    def build(*a, **kw):
        where.append(threading.current_thread())
        raise Stop

    monkeypatch.setattr(engine_mod.Engine, "build", build)
    args = type("Args", (), {"target": "t", "draft": "none", "backend": "native", "dtype": "auto", "draft_dtype": "auto"})()
    with pytest.raises(Stop):
        command.build_app(args, {})
    assert where == [COMPUTE._thread]


def test_compute_thread_runs_calls_in_order_and_hands_back_results_and_errors():
    compute = ComputeThread(name="test-compute")
    order: list[int] = []
    for i in range(5):
        compute.post(lambda i=i: order.append(i))
    assert compute.run(lambda a, b=0: a + b, 2, b=3) == 5
    assert order == [0, 1, 2, 3, 4]
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    thread = compute.run(threading.current_thread)
    compute.post(lambda: 1 / 0)  # nobody waits for a posted call: its error must not stop the thread
    after: Future = Future()
    compute.post(lambda: after.set_result(threading.current_thread()))
    assert after.result(timeout=30) is thread and thread.is_alive()  # (a stopped thread: a time-out)
    # a call made on the compute thread runs there at once (queueing it would wait forever)
    assert compute.run(lambda: compute.run(lambda: "inner")) == "inner"


def test_a_scheduler_asked_from_its_compute_thread_runs_the_pass_there():
    compute = ComputeThread(name="test-compute")
    model = _Threads(6, order=1, seed=0)
    scheduler = Scheduler(model, compute=compute)
    want = ToyLM(6, order=1, seed=0).forward(torch.tensor([1, 2]), model.new_cache())

    def inside():
        return scheduler.forward(torch.tensor([1, 2]), model.new_cache())

    done: Future = Future()
    compute.post(lambda: done.set_result(inside()))
    torch.testing.assert_close(done.result(timeout=30), want, rtol=0, atol=0)  # a deadlock times out
    assert [thread for _, thread in model.seen] == [compute._thread]


def test_one_openmp_thread_is_per_thread(two_threads):
    """The calling thread's count drops to one; the main thread and a thread started afterwards
    keep the process's; calling it on the main thread changes nothing."""
    got: dict[str, int] = {}

    def limited() -> None:
        one_openmp_thread()
        got["limited"] = torch.get_num_threads()
        torch.ones(1 << 20).sum()  # an operation that would use a team

    def plain() -> None:
        got["plain"] = torch.get_num_threads()

    for fn in (limited, plain):
        t = threading.Thread(target=fn)
        t.start()
        t.join()
    one_openmp_thread()
    assert got == {"limited": 1, "plain": 2}
    assert torch.get_num_threads() == 2


def test_calls_queued_behind_a_failing_posted_call_still_run():
    """Whatever a posted call raises (here a ValueError), the calls queued behind it run: the
    thread is held on a gate while all three are queued, so none can start a new thread."""
    compute = ComputeThread(name="test-compute-extra")
    gate = threading.Event()
    after: Future = Future()
    compute.post(gate.wait)
    compute.post(lambda: (_ for _ in ()).throw(ValueError("a posted call's bug")))
    compute.post(lambda: after.set_result("ran"))
    gate.set()
    assert after.result(timeout=30) == "ran"  # (a stopped thread: a time-out)


class _Stop(BaseException):
    """Not an Exception (as KeyboardInterrupt or SystemExit)."""


def test_a_base_exception_of_a_call_is_raised_in_the_caller():
    compute = ComputeThread(name="test-compute-extra")
    got: Future = Future()

    def ask() -> None:
        try:
            compute.run(lambda: (_ for _ in ()).throw(_Stop()))
            got.set_result("returned")
        except _Stop:
            got.set_result("raised")

    threading.Thread(target=ask, daemon=True).start()
    assert got.result(timeout=30) == "raised"  # (swallowed on the compute thread: a time-out)
    assert compute.run(lambda: 7) == 7


def test_the_compute_thread_keeps_its_openmp_team(two_threads):
    """one_openmp_thread() asked on the compute thread (a wrapper's pass running there) leaves its
    team alone: it is the one thread that runs the passes."""
    compute = ComputeThread(name="test-compute-extra")

    def inside() -> int:
        one_openmp_thread()
        return torch.get_num_threads()

    assert compute.run(inside) == 2


def test_pending_tells_whether_calls_wait_behind_the_running_one():
    """pending(): calls queued behind the one running (what the schedulers' gathering looks at, so
    that another model's pass is never held up)."""
    compute = ComputeThread(name="test-compute-extra")
    gate, running = threading.Event(), threading.Event()
    compute.post(lambda: (running.set(), gate.wait()))
    assert running.wait(30)
    assert not compute.pending()  # the running call does not count
    done: Future = Future()
    compute.post(lambda: done.set_result(compute.pending()))
    assert compute.pending()
    gate.set()
    assert done.result(timeout=30) is False  # the last call, running: nothing waits behind it


def test_run_locked_holds_the_lock_around_the_call():
    compute = ComputeThread(name="test-compute-extra")
    lock = threading.Lock()
    assert compute.run_locked(lock, lambda: lock.locked()) is True
    assert not lock.locked()


def test_one_openmp_thread_leaves_the_main_thread_alone(two_threads, monkeypatch):
    """On the main thread (a script's or a test's) it changes nothing, even as its first call there
    (a fresh thread-local state, so no earlier call in this process hides it)."""

    monkeypatch.setattr(compute_mod, "_local", threading.local())
    one_openmp_thread()
    assert torch.get_num_threads() == 2


def test_one_openmp_thread_sets_a_threads_count_once(monkeypatch):
    """Once per thread: a request thread calling it before every pass looks the OpenMP runtime up
    (reading /proc/self/maps) and sets its count only the first time."""
    looked_up: list[str] = []
    set_to: list[int] = []

    def lookup():
        looked_up.append(threading.current_thread().name)
        return set_to.append

    monkeypatch.setattr(compute_mod, "_omp_set_num_threads", lookup)

    def job():
        for _ in range(3):
            one_openmp_thread()

    t = threading.Thread(target=job, name="request")
    t.start()
    t.join()
    assert looked_up == ["request"] and set_to == [1]


@pytest.mark.parametrize("lib", ["libgomp-a34b3233.so.1", "libiomp5.so", "libomp.so"])
def test_the_openmp_runtime_is_found_whichever_torch_loaded(monkeypatch, lib):
    """GNU's libgomp, Intel's libiomp and LLVM's libomp are each found in /proc/self/maps and asked
    for omp_set_num_threads."""
    maps = f"7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n7f02-7f03 r-xp 00000000 08:01 2 /opt/torch/lib/{lib}\n"
    monkeypatch.setattr(compute_mod, "open", lambda path: io.StringIO(maps), raising=False)
    opened: list[str | None] = []

    def cdll(path):
        opened.append(path)
        return SimpleNamespace(omp_set_num_threads="setter")

    monkeypatch.setattr(compute_mod.ctypes, "CDLL", cdll)
    assert compute_mod._omp_set_num_threads() == "setter"
    assert opened == [f"/opt/torch/lib/{lib}"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the stopped thread's _Stop
def test_a_compute_thread_stopped_by_a_posted_call_is_started_again():
    """A posted call that raises a BaseException ends the compute thread (nothing catches it there);
    the next call starts a new one instead of waiting forever on a dead thread."""
    compute = ComputeThread(name="test-compute-extra")
    first = compute.run(threading.current_thread)
    compute.post(lambda: (_ for _ in ()).throw(_Stop()))
    first.join(timeout=30)
    assert not first.is_alive()
    done = threading.Event()
    got: list = []

    def ask():
        got.append(compute.run(threading.current_thread))
        done.set()

    threading.Thread(target=ask, daemon=True).start()
    assert done.wait(30)  # (a dead thread never started again: a time-out)
    assert got[0] is not first and got[0].is_alive()
