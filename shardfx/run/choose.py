"""``mesh = "auto"``: the run's mesh and how it splits the batch, chosen by ``shardfx.search``.

Requires: a config whose ``mesh`` is ``"auto"`` and ``devices`` the devices to plan for
          (``config.check_fields``); its factory loadable.
Ensures:  the config's mesh, microbatches, schedule, virtual stages, ZeRO stage, recompute
          policy and shard are the search's first choice (printed with the ranking), and
          checked against that mesh as a mesh given by hand is; a search that finds nothing
          raises its named error.
"""

from __future__ import annotations

import shardfx
from shardfx.run.config import RunConfig, check_mesh, set_fields
from shardfx.run.job import load_job
from shardfx.mesh import MeshSpec


def choose_mesh(config: RunConfig) -> None:
    """Replace ``mesh = "auto"`` by the search's first choice (module docstring)."""
    job = load_job(config.spec)
    found = shardfx.search(job.model, job.args, job.loss_fn, job.targets,
                           devices=config.devices, precision=config.precision)
    print(f'shardfx run, mesh = "auto" on {config.devices} devices:\n{found}')
    options = found.best.candidate.options()
    mesh = ",".join(f"{a}={n}" for a, n in options["mesh"].items())
    chosen = {"mesh": mesh, "devices": None, "zero": options["zero"],
              "recompute": options["recompute"], "shard": options["shard"],
              "microbatches": options["microbatches"]}
    if "schedule" in options:
        chosen.update(schedule=options["schedule"], virtual_stages=options["virtual_stages"])
    set_fields(config, chosen, 'mesh = "auto"')
    check_mesh(config, MeshSpec.parse(mesh or None))
