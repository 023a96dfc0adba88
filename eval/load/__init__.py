"""A build under load: the load generator, each level's figures, the search for the objective's edge (the users a
server holds; not the mixed-precision search, which is pipelines/search.py), the server's own view, speed-ups
between builds, and capacity and cost from the sweeps."""
