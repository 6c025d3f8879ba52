"""FLOP counting for the benchmarks: ``FlopCounterMode`` with the formulas it lacks (CPU
attention kernels, in-place ``addmm_``), through torch.compile's graphs too, and a
torch.compile backend (``aot_eager`` as torch builds it) that counts each graph's FLOPs and
runs (bench/remat.py's torch.compile rows)."""

from __future__ import annotations

import collections
import functools
from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from shardfx.cost.node import CPU_ATTENTION_FLOPS

aten = torch.ops.aten


# --- FLOPs ------------------------------------------------------------------------------------

def _addmm_inplace(*args, out_val=None, **kwargs) -> int:
    return flop_registry[aten.addmm](*args, out_val=out_val, **kwargs)


_addmm_inplace._get_raw = True  # FlopCounterMode(custom_mapping=...): already by shapes

# FlopCounterMode knows no CPU attention kernel: PyTorch's own SDPA formulas for them, as
# shardfx's cost model counts them. Nor in-place addmm_ (its registry has addmm, keyed by
# overload packet): shardfx's fused LM head sums the weight's gradient with it, chunk by
# chunk, and without a formula that matmul (2 x tokens x hidden x vocab) would count 0.
EXTRA_FLOPS = {**CPU_ATTENTION_FLOPS, aten.addmm_: _addmm_inplace}


class _CountThroughCompile(torch.utils.flop_counter._FlopCounterMode):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class FlopsThroughCompile(FlopCounterMode):
    """``FlopCounterMode`` whose dispatch mode lets torch.compile run its compiled graphs (and
    sees their ops) instead of falling back to eager."""

    def __enter__(self):
        self.flop_counts.clear()
        self.mod_tracker.__enter__()
        self.mode = _CountThroughCompile(self)
        self.mode.__enter__()
        return self


def step_flops(step: Callable, through_compile: bool) -> int:
    counter = (FlopsThroughCompile if through_compile else FlopCounterMode)(
        display=False, custom_mapping=EXTRA_FLOPS)
    with counter:
        step()
    return counter.get_total_flops()


def graph_flops(gm: torch.fx.GraphModule) -> int:
    """FLOPs of an aot_autograd graph, summed statically over its nodes with the formulas
    ``FlopCounterMode`` uses (and ``EXTRA_FLOPS``)."""
    formulas = FlopCounterMode(custom_mapping=EXTRA_FLOPS).flop_registry
    total = 0
    for node in gm.graph.nodes:
        formula = formulas.get(getattr(node.target, "overloadpacket", None))
        if node.op != "call_function" or formula is None:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        total += formula(*args, **kwargs, out_val=node.meta["val"])
    return total


# --- torch.compile backend --------------------------------------------------------------------

class CountingBackend:
    """PyTorch's ``aot_eager`` (or ``aot_eager_decomp_partition``) as torch builds it, with the
    forward and backward compilers wrapped: the FLOPs of each graph, counted from its nodes, and
    how many times each graph ran."""

    def __init__(self, name: str):
        self.name = name
        self.graphs: list[tuple[str, int]] = []  # (fw | bw, FLOPs)
        self.runs: collections.Counter = collections.Counter()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        if self.name == "aot_eager":
            kwargs = dict(partition_fn=min_cut_rematerialization_partition,
                          keep_inference_input_mutations=True)
        else:  # aot_eager_decomp_partition
            from torch._inductor.compile_fx import select_decomp_table
            kwargs = dict(decompositions=select_decomp_table(),
                          partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                         compiler="inductor"))
        return aot_autograd(fw_compiler=self._compiler("fw"), bw_compiler=self._compiler("bw"),
                            **kwargs)(gm, example_inputs)

    def _compiler(self, kind: str):
        from torch._dynamo.backends.debugging import boxed_nop

        def compile(gm: torch.fx.GraphModule, example_inputs):
            self.graphs.append((kind, graph_flops(gm)))
            inner = boxed_nop(gm, example_inputs)

            def run(args):
                self.runs[kind] += 1
                return inner(args)

            run._boxed_call = True
            return run
        return compile

    def static_flops(self) -> int:
        return sum(f for _, f in self.graphs)
