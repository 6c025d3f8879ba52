"""On CPU a collective's wait returns once gloo's worker has let go of its buffers
(``runtime.released``): the result (or views of it: gloo's all-gather holds one per rank) and
the inputs the program dropped when it issued the collective, so each is freed where the
program drops it, as the memory model counts. With a plain ``wait_tensor`` the worker still
holds the result after about one wait in six, and the buffer then outlives its last reader by
a moment thread scheduling decides."""

from __future__ import annotations

import threading
import time
import weakref

import torch
import torch.distributed as dist
import torch.fx as fx

import shardfx
from shardfx.runtime.measure import measured_peak
from shardfx.runtime.released import dropped_input, gather_alone, released, wait_released

c10d = torch.ops._c10d_functional
ROWS = 4096  # floats: 16 KiB per value


def _program(group: str) -> fx.GraphModule:
    """x -> all-reduce -> wait -> (* 2) -> (+ 1): the all-reduce's buffer dies at the mul."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(c10d.wait_tensor.default,
                            (graph.call_function(c10d.all_reduce.default, (x, "sum", group)),))
    z = graph.call_function(torch.ops.aten.mul.Tensor, (y, 2.0))
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (z, 1.0)),))
    return fx.GraphModule(torch.nn.Module(), graph)


def _owners(runs: int) -> tuple[int, list[int]]:
    """Owners of an all-reduce's result after each of ``runs`` released waits; the released
    program's peak."""
    group = dist.group.WORLD.group_name
    x = torch.randn(ROWS)
    owners = [wait_released(c10d.all_reduce.default(x, "sum", group))._use_count()
              for _ in range(runs)]
    program = released(_program(group), torch.device("cpu"))
    return measured_peak(lambda: program(x), x).total - x.nbytes, owners


def test_a_collective_buffer_is_the_programs_alone_after_its_wait():
    for peak, owners in shardfx.launch(_owners, 200, nprocs=2):
        assert set(owners) == {1}, owners
        assert peak == 2 * 4 * ROWS  # at the add: the mul's and its own; the all-reduce's went


def test_only_cpu_programs_are_copied():
    program = _program("any")
    assert released(program, torch.device("meta")) is program
    copy = released(program, torch.device("cpu"))
    assert copy is not program and released(program, torch.device("cpu")) is copy
    assert copy.graph.find_nodes(op="call_function", target=wait_released)
    assert program.graph.find_nodes(op="call_function", target=c10d.wait_tensor.default)


def _let_go_later(*held: list) -> threading.Thread:
    """A thread standing for gloo's worker: it lets go of what ``held`` holds in 5 ms."""
    def run():
        time.sleep(0.005)
        for h in held:
            h.clear()
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_wait_waits_for_views_of_the_result_and_for_the_dropped_inputs():
    """The released copy's wait holds a weak reference to the all-gather's input made in the
    program (``x * 2``), dropped where the gather is issued; not to the placeholder, which the
    caller holds. A wait returns only once the last view of its result held elsewhere, and
    each dropped input, is gone."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    gathers = [graph.call_function(c10d.all_gather_into_tensor.default, (v, 2, "g"))
               for v in (doubled, x)]
    graph.output(tuple(graph.call_function(c10d.wait_tensor.default, (g,)) for g in gathers))
    copy = released(fx.GraphModule(torch.nn.Module(), graph), torch.device("cpu"))
    waits = copy.graph.find_nodes(op="call_function", target=wait_released)
    assert [[a.args[0].name for a in w.args[1:]] for w in waits] == [[doubled.name], []]
    assert all(a.target is dropped_input for w in waits for a in w.args[1:])
    assert [n.target for n in gathers] == [c10d.all_gather_into_tensor.default] * 2
    assert len(copy.graph.find_nodes(op="call_function", target=gather_alone)) == 2

    result = torch.zeros(4)
    views, dropped = list(result.chunk(2)), [torch.ones(4)]
    gone = weakref.ref(dropped[0])
    worker = _let_go_later(views, dropped)
    out = wait_released(result, gone)
    assert not views and gone() is None  # returned after the worker let go, not before
    assert out is result
    worker.join()


def _gathers_in_flight(rounds: int) -> int:
    """Two all-gathers issued before either is waited, as ZeRO-3's prefetch issues them,
    through the released copy's ``gather_alone``: each result is every rank's block in rank
    order. (Both in flight at once, this loop corrupted gloo's heap within seconds.)"""
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    wrong = 0
    for i in range(rounds):
        blocks = [torch.full((n,), float(rank * 1000 + i)) for n in (8, 4640)]
        flying = [gather_alone(b, size, group) for b in blocks]
        del blocks
        for n, f in zip((8, 4640), flying):
            got = wait_released(f).view(size, n)
            want = (torch.arange(size) * 1000.0 + i).unsqueeze(1).expand(size, n)
            wrong += not torch.equal(got, want)
    return wrong


def test_all_gathers_in_flight_together_gather_every_rank_in_order():
    assert shardfx.launch(_gathers_in_flight, 500, nprocs=2) == [0, 0]
