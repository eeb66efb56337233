"""``service.control.placement.place``: the rules, as plain tables of cases."""

from __future__ import annotations

from typing import Any

import pytest

from service.control.placement import Decision, QueuedRow, WorkerRow, place
from service.core.modelconfig import RequestLen

pytestmark = pytest.mark.unit

A, B, C = "kind-a", "kind-b", "kind-c"


def w(id: str, key: str, **kw: Any) -> WorkerRow:
    gpus = kw.pop("gpus", "")
    return WorkerRow(id=id, key=key, gpus=tuple(gpus.split(",")) if gpus else (), **kw)


def q(id: str, key: str, tp: int = 1) -> QueuedRow:
    return QueuedRow(id=id, key=key, tensor_parallel_size=tp)


CASES: list[tuple[str, list[QueuedRow], list[WorkerRow], list[tuple[str, list[str]]], str,
                  list[Decision]]] = [
    # name, queued, workers, starting, gpus, expected decisions
    ("cpu: first run starts a worker",
     [q("r1", A)], [], [], "",
     [Decision("r1", A)]),
    ("cpu: an idle worker of the kind is reused",
     [q("r1", A)], [w("w1", A)], [], "",
     [Decision("r1", A, reuse="w1")]),
    ("cpu: one run at a time per kind; the next waits",
     [q("r1", A), q("r2", A)], [w("w1", A)], [], "",
     [Decision("r1", A, reuse="w1")]),
    ("cpu: another kind evicts the idle worker",
     [q("r1", B)], [w("w1", A)], [], "",
     [Decision("r1", B, evict=("w1",))]),
    ("cpu: another kind waits while a run is going, and so does everything behind it",
     [q("r1", B), q("r2", A)], [w("w1", A, busy=True)], [], "",
     [], ),
    ("cpu: nothing starts while a worker is starting",
     [q("r1", B)], [], [(A, [])], "",
     []),
    ("cpu: a worker that is starting is not evicted",
     [q("r1", B)], [w("w1", A, ready=False)], [], "",
     []),
    ("registered servers only: a busy one lets later runs of other kinds pass",
     [q("r1", A), q("r2", B)], [w("x1", A, external=True, busy=True), w("w2", B)], [], "",
     [Decision("r2", B, reuse="w2")]),
    ("registered servers are never evicted and hold no GPUs",
     [q("r1", B)], [w("x1", A, external=True, gpus="0")], [], "0",
     [Decision("r1", B, gpus=("0",))]),
    ("gpus: a new worker takes the lowest free GPUs",
     [q("r1", A, tp=2)], [w("w1", B, gpus="0")], [], "0,1,2,3",
     [Decision("r1", A, gpus=("1", "2"))]),
    ("gpus: runs of other kinds side by side in one pass",
     [q("r1", A), q("r2", B, tp=2), q("r3", C)], [], [], "0,1,2,3",
     [Decision("r1", A, gpus=("0",)), Decision("r2", B, gpus=("1", "2")),
      Decision("r3", C, gpus=("3",))]),
    ("gpus: GPUs of a run still starting are held",
     [q("r1", B)], [], [(A, ["0"])], "0",
     []),
    ("gpus: least recently used idle worker is evicted first",
     [q("r1", C)], [w("w1", A, gpus="0", last_used=20.0), w("w2", B, gpus="1", last_used=10.0)], [],
     "0,1", [Decision("r1", C, gpus=("1",), evict=("w2",))]),
    ("gpus: busy and starting workers are never evicted",
     [q("r1", C)], [w("w1", A, gpus="0", busy=True), w("w2", B, gpus="1", ready=False)], [], "0,1",
     []),
    ("gpus: a worker set aside for eviction holds its other GPU until it has stopped",
     [q("r1", C), q("r2", A)], [w("w1", B, gpus="0,1")], [], "0,1",
     [Decision("r1", C, gpus=("0",), evict=("w1",))]),
    ("gpus: a stopping worker (from an earlier pass) still holds its GPUs",
     [q("r1", C)], [w("w1", B, gpus="0,1", stopping=True)], [(A, ["0"])], "0,1",
     []),
    ("gpus: a stopping worker is not reused for its kind",
     [q("r1", B)], [w("w1", B, gpus="0", stopping=True)], [], "0,1",
     [Decision("r1", B, gpus=("1",))]),
    ("gpus: tensor parallel larger than the machine fails, the queue goes on",
     [q("r1", A, tp=8), q("r2", B)], [], [], "0,1",
     [Decision("r1", A, fail="tensor_parallel_size 8 needs more GPUs than this service may use "
               "(2: 0,1)"), Decision("r2", B, gpus=("0",))]),
    ("gpus: first come, first served: a run that must wait holds back the ones behind it",
     [q("r1", A, tp=2), q("r2", B)], [w("w1", C, gpus="0", busy=True)], [], "0,1",
     []),
    # Several servers of one kind: one per run, one run per server.
    ("gpus: runs of one kind start a server each, each on its own GPU",
     [q("r1", A), q("r2", A), q("r3", A), q("r4", A)], [], [], "0,1,2,3",
     [Decision("r1", A, gpus=("0",)), Decision("r2", A, gpus=("1",)),
      Decision("r3", A, gpus=("2",)), Decision("r4", A, gpus=("3",))]),
    ("gpus: the kind's server is busy: each other run starts one more beside it",
     [q("r1", A), q("r2", A), q("r3", A)], [w("w1", A, gpus="0", busy=True)], [], "0,1,2,3",
     [Decision("r1", A, gpus=("1",)), Decision("r2", A, gpus=("2",)),
      Decision("r3", A, gpus=("3",))]),
    ("gpus: tensor parallel 2 on four GPUs runs two at a time; the third waits",
     [q("r1", A, tp=2), q("r2", A, tp=2), q("r3", A, tp=2)], [], [], "0,1,2,3",
     [Decision("r1", A, gpus=("0", "1")), Decision("r2", A, gpus=("2", "3"))]),
    ("gpus: an idle server of the kind is taken before another is started",
     [q("r1", A), q("r2", A)], [w("w1", A, gpus="2")], [], "0,1,2,3",
     [Decision("r1", A, reuse="w1"), Decision("r2", A, gpus=("0",))]),
    ("gpus: another server of the kind starts while its first is still starting",
     [q("r1", A)], [], [(A, ["0"])], "0,1",
     [Decision("r1", A, gpus=("1",))]),
    ("gpus: a second server evicts the least recently used idle worker of another kind",
     [q("r1", A)],
     [w("w1", A, gpus="0", busy=True), w("w2", B, gpus="1", last_used=20.0),
      w("w3", C, gpus="2", last_used=10.0)], [], "0,1,2",
     [Decision("r1", A, gpus=("2",), evict=("w3",))]),
    ("gpus: a second server never evicts a busy worker of another kind",
     [q("r1", A)], [w("w1", A, gpus="0", busy=True), w("w2", B, gpus="1", busy=True)], [], "0,1",
     []),
    ("gpus: a second server never evicts a starting worker of another kind",
     [q("r1", A)], [w("w1", A, gpus="0", busy=True), w("w2", B, gpus="1", ready=False)], [], "0,1",
     []),
    ("gpus: the kind's own worker is never evicted: the next run of the kind waits for it",
     [q("r1", A), q("r2", A)], [w("w1", A, gpus="0")], [], "0",
     [Decision("r1", A, reuse="w1")]),
    ("gpus: a sweep's points fill the GPUs; a later kind waits its turn",
     [q("r1", A), q("r2", A), q("r3", B)], [], [], "0,1",
     [Decision("r1", A, gpus=("0",)), Decision("r2", A, gpus=("1",))]),
    ("gpus: a run of another kind keeps running beside the new kind's servers",
     [q("r1", A), q("r2", A)], [w("w1", B, gpus="0", busy=True)], [], "0,1,2",
     [Decision("r1", A, gpus=("1",)), Decision("r2", A, gpus=("2",))]),
    ("gpus: a kind served by registered servers only waits for them, starting none here",
     [q("r1", A), q("r2", A), q("r3", B)], [w("x1", A, external=True, busy=True)], [], "0,1",
     [Decision("r3", B, gpus=("0",))]),
    ("gpus: a kind with a local server beside its registered ones may start another",
     [q("r1", A)], [w("x1", A, external=True, busy=True), w("w1", A, gpus="0", busy=True)], [],
     "0,1", [Decision("r1", A, gpus=("1",))]),
    ("cpu: runs of one kind still share its one worker, one at a time",
     [q("r1", A), q("r2", A)], [w("w1", A, busy=True)], [], "",
     []),
    ("cpu: no second worker of a kind while its first is starting",
     [q("r1", A)], [], [(A, [])], "",
     []),
]


@pytest.mark.parametrize(("queued", "workers", "starting", "gpus", "expected"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_place(queued: list[QueuedRow], workers: list[WorkerRow], starting: list[tuple[str, list[str]]],
               gpus: str, expected: list[Decision]) -> None:
    assert place(queued, workers, starting, gpus.split(",") if gpus else []) == expected


def pq(id: str, pair: str) -> QueuedRow:
    return QueuedRow(id=id, key=A, pair_id=pair)


PAIR_CASES: list[tuple[str, list[QueuedRow], list[WorkerRow], set[str], dict[str, str],
                       list[Decision]]] = [
    # name, queued, workers, busy pairs, the server a pair's ended run ran on, expected
    ("gpus: a pair's second run waits for its first; the next pair goes past it",
     [pq("r1", "p1"), pq("r2", "p1"), pq("r3", "p2"), pq("r4", "p2")], [], set(), {},
     [Decision("r1", A, gpus=("0",)), Decision("r3", A, gpus=("1",))]),
    ("gpus: a run whose partner is running waits, though a server is idle",
     [pq("r2", "p1"), pq("r3", "p2")], [w("w1", A, gpus="0", busy=True), w("w2", A, gpus="1")],
     {"p1"}, {}, [Decision("r3", A, reuse="w2")]),
    ("gpus: a run takes the server its partner ran on",
     [pq("r2", "p1")], [w("w1", A, gpus="0"), w("w2", A, gpus="1")], set(), {"p1": "w2"},
     [Decision("r2", A, reuse="w2")]),
    ("gpus: another idle server when the partner's is busy",
     [pq("r2", "p1")], [w("w1", A, gpus="0"), w("w2", A, gpus="1", busy=True)], set(), {"p1": "w2"},
     [Decision("r2", A, reuse="w1")]),
]


@pytest.mark.parametrize(("queued", "workers", "busy", "servers", "expected"),
                         [c[1:] for c in PAIR_CASES], ids=[c[0] for c in PAIR_CASES])
def test_place_pairs(queued: list[QueuedRow], workers: list[WorkerRow], busy: set[str],
                     servers: dict[str, str], expected: list[Decision]) -> None:
    assert place(queued, workers, [], ["0", "1"], busy_pairs=busy, pair_servers=servers) == expected


FITTED = "the longest server w1 fits (vLLM auto-fit to its KV cache memory); lower input_len or output_len"
LONGER = "the longest server w2 fits (vLLM auto-fit to its KV cache memory); lower input_len or output_len"


def lq(id: str, key: str, input: int, output: int = 128, range_ratio: float = 0.0) -> QueuedRow:
    return QueuedRow(id=id, key=key, longest=RequestLen(input, output, range_ratio))


def fw(id: str, key: str, max_model_len: int | None, why: str = FITTED, **kw: Any) -> WorkerRow:
    return w(id, key, max_model_len=max_model_len, max_len_why=why, **kw)


LENGTH_CASES: list[tuple[str, list[QueuedRow], list[WorkerRow], str, list[Decision]]] = [
    # name, queued, workers, gpus, expected decisions
    ("cpu: a run that fits its kind's server takes it",
     [lq("r1", A, 880)], [fw("w1", A, 1008)], "",
     [Decision("r1", A, reuse="w1")]),
    ("cpu: a run exactly as long as the server's max_model_len takes it",
     [lq("r1", A, 880, 128)], [fw("w1", A, 1008)], "",
     [Decision("r1", A, reuse="w1")]),
    ("cpu: a run longer than its kind's server fails at once, with the sums",
     [lq("r1", A, 1024)], [fw("w1", A, 1008)], "",
     [Decision("r1", A, fail=f"infeasible: input 1024 + output 128 = 1152 tokens > 1008, {FITTED}")]),
    ("cpu: the server being busy does not hold the failure; the queue goes on past it",
     [lq("r1", A, 1024), lq("r2", B, 16)], [fw("w1", A, 1008, busy=True), fw("w2", B, 1008)], "",
     [Decision("r1", A, fail=f"infeasible: input 1024 + output 128 = 1152 tokens > 1008, {FITTED}"),
      Decision("r2", B, reuse="w2")]),
    ("range_ratio: the longest request is held to the length, and the message says so",
     [lq("r1", A, 990, 150, 0.1)], [fw("w1", A, 1008)], "",
     [Decision("r1", A, fail="infeasible: input 990 + output 150 = 1140 tokens (the longest request at "
               f"range_ratio 0.1) > 1008, {FITTED}")]),
    ("another kind's shorter server is no reason to fail",
     [lq("r1", B, 1024)], [fw("w1", A, 1008)], "",
     [Decision("r1", B, evict=("w1",))]),
    ("a server that has not said its length may take the run",
     [lq("r1", A, 1024)], [fw("w1", A, None)], "",
     [Decision("r1", A, reuse="w1")]),
    ("a server still starting is not held against the run: it waits for it",
     [lq("r1", A, 1024)], [fw("w1", A, 1008, ready=False)], "",
     []),
    ("a stopping server's length is not held against the run",
     [lq("r1", A, 1024)], [fw("w1", A, 1008, gpus="0", stopping=True)], "0,1",
     [Decision("r1", A, gpus=("1",))]),
    ("registered servers that all said a shorter length fail the run, naming the longest",
     [lq("r1", A, 100, 8)],
     [fw("x1", A, 64, "the max_model_len of the registered server http://a", external=True),
      fw("x2", A, 96, "the max_model_len of the registered server http://b", external=True)], "",
     [Decision("r1", A, fail="infeasible: input 100 + output 8 = 108 tokens > 96, the max_model_len of the "
               "registered server http://b")]),
    ("gpus: the longest of the kind's servers is the limit",
     [lq("r1", A, 2048)], [fw("w1", A, 1008, gpus="0"), fw("w2", A, 2048, LONGER, gpus="1")], "0,1",
     [Decision("r1", A, fail=f"infeasible: input 2048 + output 128 = 2176 tokens > 2048, {LONGER}")]),
    ("gpus: a shorter idle server is not given the run; it waits for the one it fits",
     [lq("r1", A, 1024)], [fw("w1", A, 1008, gpus="0"), fw("w2", A, 4096, gpus="1", busy=True)],
     "0,1", []),
    ("gpus: of two idle servers the run takes the one it fits",
     [lq("r1", A, 1024)], [fw("w1", A, 1008, gpus="0"), fw("w2", A, 4096, gpus="1")], "0,1",
     [Decision("r1", A, reuse="w2")]),
]


@pytest.mark.parametrize(("queued", "workers", "gpus", "expected"),
                         [c[1:] for c in LENGTH_CASES], ids=[c[0] for c in LENGTH_CASES])
def test_place_lengths(queued: list[QueuedRow], workers: list[WorkerRow], gpus: str,
                       expected: list[Decision]) -> None:
    assert place(queued, workers, [], gpus.split(",") if gpus else []) == expected


def test_the_pass_names_the_run_that_stopped_it_and_none_when_every_run_held_nothing() -> None:
    registered = [w("x1", A, external=True, busy=True)]
    stopped: list[str] = []
    # Runs waiting for a registered server hold nothing: the pass goes past every one.
    assert place([q("r1", A), q("r2", A)], registered, [], []) == []
    place([q("r1", A), q("r2", A)], registered, [], [], stopped=stopped)
    assert stopped == []
    # A run of a kind whose local worker is busy waits for it, and everything behind it.
    place([q("r1", A), q("r2", B), q("r3", C)], [*registered, w("w2", B, busy=True)], [], [],
          stopped=stopped)
    assert stopped == ["r2"]


NO_CPU = "synthetic acceptance needs a GPU server"
NO_CPU_FAIL = (f"{NO_CPU}; this service starts its servers on this machine's CPU "
               "(it has no GPUs: DECODEBENCH_GPUS)")


def cq(id: str, key: str) -> QueuedRow:
    return QueuedRow(id=id, key=key, cpu_problem=NO_CPU)


CPU_CASES: list[tuple[str, list[QueuedRow], list[WorkerRow], str, list[Decision]]] = [
    # name, queued, workers, gpus, expected decisions
    ("cpu: a run no CPU server can serve fails at once, and the queue goes on past it",
     [cq("r1", A), q("r2", B)], [], "",
     [Decision("r1", A, fail=NO_CPU_FAIL), Decision("r2", B)]),
    ("cpu: it takes an idle registered server of its kind",
     [cq("r1", A)], [w("x1", A, external=True)], "",
     [Decision("r1", A, reuse="x1")]),
    ("cpu: it waits for a busy registered server of its kind",
     [cq("r1", A)], [w("x1", A, external=True, busy=True)], "",
     []),
    ("gpus: it starts a server on a GPU",
     [cq("r1", A)], [], "0",
     [Decision("r1", A, gpus=("0",))]),
]


@pytest.mark.parametrize(("queued", "workers", "gpus", "expected"),
                         [c[1:] for c in CPU_CASES], ids=[c[0] for c in CPU_CASES])
def test_place_what_a_cpu_cannot_serve(queued: list[QueuedRow], workers: list[WorkerRow], gpus: str,
                                       expected: list[Decision]) -> None:
    assert place(queued, workers, [], gpus.split(",") if gpus else []) == expected
