"""Process runtime settings of kvflow's own processes (foundation): ``openmp_env`` (before the
OpenMP runtime loads), ``malloc_env`` (glibc malloc), ``gc_heap`` (the start-up heap frozen out
of the cyclic GC), ``exit_threads`` (daemon threads the interpreter's exit stops).
"""
