"""What a plan does with its mixture-of-experts layers, for ``print(plan)`` and ``plan.html``:
each layer's experts and where they live, its capacity, its all-to-alls, and the routing of
the last step a runner took (tokens per expert, tokens dropped)."""

from __future__ import annotations

from dataclasses import dataclass

from shardfx.ir import meta as M
from shardfx.kernels.experts import EXPERTS
from shardfx.ir.units import nbytes


@dataclass(frozen=True)
class ExpertLayer:
    name: str  # the experts module's FQN (or the name given to shardfx.experts)
    experts: int
    ranks: int  # ep: the ranks its experts are spread over
    capacity: float  # the capacity factor; 0: dropless

    @property
    def held(self) -> int:
        return self.experts // self.ranks

    def where(self) -> str:
        if self.ranks == 1:
            return f"all {self.experts} on every rank"
        return (f"{self.held} per rank over ep={self.ranks}: ep rank r holds experts "
                f"{self.held}r .. {self.held}r+{self.held - 1}")


def expert_layers(plan) -> list[ExpertLayer]:
    """The plan's MoE layers, in model order."""
    ep = plan.mesh.axis("ep")
    out = []
    for node in plan.ir.graph.find_nodes(op="call_function", target=EXPERTS):
        if node.meta.get(M.PHASE) is M.Phase.BACKWARD:  # a recomputation (auto.remat)
            continue
        w_in, capacity, layer = node.args[3], node.args[-2], node.args[-1]
        out.append(ExpertLayer(layer, w_in.meta[M.VAL].shape[0], ep, capacity))
    return out


def notes(plan) -> list[str]:
    """Lines for ``print(plan)``: empty without experts."""
    layers = expert_layers(plan)
    if not layers:
        return []
    first = layers[0]
    mode = f"capacity factor {first.capacity:g}" if first.capacity else "dropless"
    moved = [c for c in plan.collectives if c.kind == "all_to_all"]
    lines = [f"Experts: {len(layers)} mixture-of-experts layers, {first.experts} experts each, "
             f"{first.where()}; {mode}"
             + (f"; {len(moved)} all-to-alls a step, {nbytes(sum(c.nbytes for c in moved))} in "
                "(on the even routing)" if moved else "")]
    routing = getattr(plan, "routing", None)
    if routing is not None:
        scope, routed = routing
        lines.append(f"Routing in the last step ({scope}):")
        lines += [f"  {name}: {r}" for name, r in routed.items()]
    return lines
