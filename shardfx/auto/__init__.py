"""The sharding solver behind ``shard="auto"``: every op's candidate strategies
(``candidates``), what each costs on the device model (``costs``), and the integer program that
chooses among them (``ilp``). ``auto.shard`` runs it."""
