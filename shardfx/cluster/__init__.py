"""``shardfx.search``: the plan for N devices, chosen among every mesh, batch split, schedule,
ZeRO stage and recompute policy the model allows (``space``), each priced on the device model
from the passes of shallow plans (``blocks``) composed (``compose``), the fastest planned in
full (``driver``) and reported (``report``)."""
