"""The solvers: ``shard="auto"``'s placements (``shard``, the pass; ``candidates``, every op's
strategies; ``costs``, their prices on the device model; ``ilp``, the integer program that
chooses), the ZeRO stage (``zero_stage``) and what to recompute under a memory budget
(``remat``, ``remat_search``)."""
