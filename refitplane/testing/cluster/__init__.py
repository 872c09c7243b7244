"""A refit deployment made of real processes, for the soak benchmark and the reliability
tests:

    proc_cluster      redis-server, the coordinator process and agent ranks of one job;
                      refits driven through the client
    processes         each of those processes: start, kill, freeze, restart, stop, logs
    agent_procs       one trainer or generator rank as its own process (`python -m ...`)
    faulty_transport  the production Gloo transport plus faults a test arms (stall, slow,
                      corrupt), installed in every agent process
    synthetic_state   the small deterministic model those ranks hold, and digests of it
    soak              refits back to back with a crowd of registered agents, sampling every
                      process's memory, threads, descriptors and communicators
"""
