"""codegen.bucketing: DDP-style gradient buckets in the per-device program.

Structural: a 3-layer MLP on dp=2 with a bucket cap that makes several buckets; each bucket is
flattened and reduced right after its last gradient is produced, and waited for only at the end.
Numeric: on two real processes the bucketed program gives bit-identical losses, gradients and
updated parameters to the unbucketed one.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import shardfx
from shardfx.codegen.bucketing import bucket_gradients
from shardfx.codegen.spmd import generate_spmd

c10d = torch.ops._c10d_functional
X, Y = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), \
    torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
# The MLP's gradients are 16 to 1024 bytes, about 1.9 KB in all: a 1100-byte cap makes several
# buckets.
CAP = 1100


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


class Mixed(torch.nn.Module):
    """An fp32 layer then an fp64 one: their gradients cannot share a flat buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4, dtype=torch.float64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).double()).float()


def plan_of(model: torch.nn.Module) -> shardfx.Plan:
    """A dp=2 plan whose program reduces each gradient on its own, as ``generate_spmd`` emits
    it (whether or not the pipeline buckets afterwards)."""
    plan = shardfx.partition(model, (X,), F.mse_loss, (Y,), mesh={"dp": 2}, shard="replicate")
    plan.program = generate_spmd(plan.ir)
    plan.collectives = list(plan.program.collectives)
    return plan


def all_reduces(program) -> list[torch.fx.Node]:
    return list(program.module.graph.find_nodes(op="call_function",
                                                target=c10d.all_reduce.default))


def reduced_grads(program) -> list[str]:
    """The nodes (by name) that compute a gradient returned as ``wait(all_reduce(grad))``."""
    returned = set(program.module.graph.output_node().args[0])
    return [r.args[0].name for r in all_reduces(program)
            if any(w.target == c10d.wait_tensor.default and w in returned for w in r.users)]


def buckets_of(program) -> list[list[torch.fx.Node]]:
    """Per ``bucketN_all_reduce``, in N order: the gradient nodes flattened into it."""
    reduces = [n for n in all_reduces(program) if n.name.startswith("bucket")]
    assert [n.name for n in reduces] == [f"bucket{i}_all_reduce" for i in range(len(reduces))]
    out = []
    for reduce in reduces:
        flat = reduce.args[0]
        views = flat.args[0] if flat.target == torch.ops.aten.cat.default else [flat]
        out.append([v.args[0] for v in views])
    return out


def nbytes(node: torch.fx.Node) -> int:
    return node.meta["val"].numel() * node.meta["val"].element_size()


def test_buckets_are_reduced_as_grads_become_ready_and_waited_at_the_end():
    plan = plan_of(mlp())
    program = bucket_gradients(plan.program, bucket_bytes=CAP)
    collectives = program.collectives
    nodes = list(program.module.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    source = program.source

    # every returned gradient's all_reduce went into a bucket; one all_reduce per bucket
    buckets = buckets_of(program)
    grads = reduced_grads(plan.program)
    assert len(buckets) >= 2 and len(grads) >= 3, source
    assert sorted(g.name for b in buckets for g in b) == sorted(grads), source
    assert reduced_grads(program) == [] and \
        len(all_reduces(program)) == len(all_reduces(plan.program)) - len(grads) + len(buckets)

    # filled in the order the gradients become ready, each up to the cap (DDP's greedy fill)
    ready = [order[g] for b in buckets for g in b]
    assert ready == sorted(ready), source
    for i, b in enumerate(buckets):
        assert sum(map(nbytes, b)) <= CAP or len(b) == 1
        if i + 1 < len(buckets):
            assert sum(map(nbytes, b)) + nbytes(buckets[i + 1][0]) > CAP

    for i, b in enumerate(buckets):
        # issued right after the bucket's last gradient: only its flattening in between
        reduce, first_view = by_name[f"bucket{i}_all_reduce"], by_name[f"bucket{i}_in0"]
        assert nodes[order[first_view] - 1] is b[-1], source
        assert order[reduce] == order[first_view] + len(b) + (len(b) > 1), source
        if i + 1 < len(buckets):  # later backward work (the next bucket's) overlaps it
            assert order[reduce] < order[buckets[i + 1][-1]], source

    # the waits, and the unflattening, come after everything else
    tail = [n.name for n in nodes[order[by_name["bucket0_wait"]]:-1]]
    assert all(name.startswith("bucket") for name in tail), source
    assert all(f"bucket{i}_wait" in tail for i in range(len(buckets))), source
    assert "bucket0_flat = torch.ops.aten.cat.default" in program.module.code
    assert "bucket0_all_reduce = torch.ops._c10d_functional.all_reduce.default(bucket0_flat" \
        in program.module.code

    # every new node has its local value; the program's calling convention is unchanged
    assert all("val" in n.meta for n in nodes if n.op == "call_function"), source
    assert (program.inputs, program.outputs) == (plan.program.inputs, plan.program.outputs)

    # accounting: the per-gradient records became one per bucket, the rest is kept
    kept = [c for c in plan.collectives if not c.reason.startswith("return grad")]
    assert [c for c in collectives if "gradient bucket" not in c.reason] == kept
    assert [c.reason.split(" (")[0] for c in collectives if c not in kept] == \
        [f"dp gradient bucket {i}" for i in range(len(buckets))]
    first, n = next(c for c in collectives if c not in kept), len(buckets[0])
    assert first.reason.startswith(f"dp gradient bucket 0 ({n} grad{'s' * (n > 1)}: ")
    assert first.reason.endswith("): P -> R on dp"), first.reason
    assert sum(c.nbytes for c in collectives) == sum(c.nbytes for c in plan.collectives)


def test_default_cap_makes_one_bucket_and_leaves_the_input_program_alone():
    plan = plan_of(mlp())
    before = plan.program.module.code
    program = bucket_gradients(plan.program)
    collectives = program.collectives
    grads = reduced_grads(plan.program)
    assert plan.program.module.code == before
    assert len(buckets_of(program)) == 1 and len(buckets_of(program)[0]) == len(grads)
    assert len(all_reduces(program)) == len(all_reduces(plan.program)) - len(grads) + 1
    assert len(collectives) == len(plan.collectives) - len(grads) + 1


def test_one_bucket_per_dtype():
    plan = plan_of(Mixed())
    program = bucket_gradients(plan.program)
    collectives = program.collectives
    buckets = buckets_of(program)
    dtypes = [{g.meta["val"].dtype for g in b} for b in buckets]
    assert sorted(map(str, dtypes)) == ["{torch.float32}", "{torch.float64}"], program.source
    reasons = [c.reason for c in collectives if "gradient bucket" in c.reason]
    # b's gradients are ready first
    assert [r.split(": ")[1].split(".")[0] for r in reasons] == ["b", "a"], reasons


# --- numeric: bucketed and unbucketed programs agree bit for bit, on real processes ------------


def _bucketed_vs_unbucketed(make: str, bucket_bytes: int) -> list[str]:
    """On every rank: two SGD steps through each program; the names of what differs."""
    plan = plan_of(mlp() if make == "mlp" else Mixed())
    bucketed = copy.copy(plan)
    bucketed.program = bucket_gradients(plan.program, bucket_bytes=bucket_bytes)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    runners = [p.runner(optimizer=sgd, keep_grads=True) for p in (plan, bucketed)]
    g = torch.Generator().manual_seed(2)
    differ = []
    for step in range(2):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        losses = [r.step((x,), (y,)) for r in runners]
        grads = [r.grads() for r in runners]
        differ += [f"step {step} loss"] * (not torch.equal(*losses))
        differ += [f"step {step} grad {k}" for k in grads[0]
                   if not torch.equal(grads[0][k], grads[1][k])]
    states = [r.state_dict() for r in runners]
    differ += [f"param {k}" for k in states[0] if not torch.equal(states[0][k], states[1][k])]
    return differ


@pytest.mark.parametrize("make, bucket_bytes",
                         [("mlp", CAP), ("mlp", 25 * 2**20), ("mixed", CAP)])
def test_bucketed_program_computes_the_same_bits(make, bucket_bytes):
    assert shardfx.launch(_bucketed_vs_unbucketed, make, bucket_bytes, nprocs=2, timeout=60) \
        == [[], []]


def _pipeline_buckets():
    """On each of 2 replicas: a stage's gradients of mixed dtypes through the program passes
    with a 100-byte cap, cut into parts (``codegen.replicas``) and run by ``ReplicaBuckets``
    as the gradients become final one at a time."""

    import torch.distributed as dist

    from shardfx.codegen.bucketing import bucket_gradients
    from shardfx.codegen.replicas import cut, replica_program
    from shardfx.runtime.buckets import ReplicaBuckets

    rank = dist.get_rank()
    shapes = [(8, torch.float32), (16, torch.float32), (4, torch.bfloat16), (40, torch.float32)]
    with FakeTensorMode():
        fake = [(f"g{i}", torch.empty(n, dtype=dtype)) for i, (n, dtype) in enumerate(shapes)]
    reduction = cut(bucket_gradients(replica_program(fake), bucket_bytes=100, in_place=True))
    buckets = ReplicaBuckets({0: reduction}, dist.group.WORLD.group_name, torch.device("cpu"))
    grads = {f"g{i}": torch.full((n,), float(rank + i), dtype=dtype)
             for i, (n, dtype) in enumerate(shapes)}
    buckets.start()
    started = []
    for name in grads:
        buckets.final(name, grads)
        started.append(len(buckets._started))
    sums = [g.float().unique().tolist() for g in buckets.finish().values()]
    return [b.names for b in reduction.buckets], started, buckets.collectives, sums


def test_pipeline_replicas_reduce_each_bucket_once_it_is_final():
    """runtime.buckets: fp32 8 + 16 floats (96 bytes) fill a bucket, the bf16 one gets its
    own, the 160-byte one (over the cap) another; each bucket starts as soon as its last
    gradient is final, and each gradient ends as the sum of the two replicas' (rank + i)."""
    for names, started, collectives, sums in shardfx.launch(_pipeline_buckets, nprocs=2):
        assert names == [("g0", "g1"), ("g2",), ("g3",)]
        assert started == [0, 1, 2, 3] and collectives == 3
        assert sums == [[1.0], [3.0], [5.0], [7.0]]


def test_interleaved_stages_finish_their_gradients_at_different_actions():
    """With two stages per rank, a rank's later stage has its gradients final actions before
    the rank's last: their buckets reduce while it still computes."""
    from shardfx.estimate.memory_pipeline import final_gradients

    from models import lm_loss, tiny, token_batches

    (x,), (y,) = token_batches(1)[0]
    plan = shardfx.partition(tiny("llama", 4), (x,), lm_loss, (y,), mesh={"pp": 2},
                             microbatches=2, schedule="interleaved-1f1b")
    steps = plan.compiled_stages().steps(0)
    done_at = [i for i, names in enumerate(final_gradients(steps)) if names]
    assert len(done_at) == 2 and done_at[0] < len(steps) - 1, done_at
