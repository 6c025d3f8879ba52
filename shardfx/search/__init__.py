"""``shardfx.search``: the plan for N devices, chosen among every mesh, batch split, schedule,
ZeRO stage and recompute policy the model allows (``space``), each priced on the device model."""
