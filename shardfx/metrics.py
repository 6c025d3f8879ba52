"""``shardfx.metrics``, kept for scripts that import it here: it is ``shardfx.run.metrics``."""

from shardfx.run.metrics import *  # noqa: F401,F403
