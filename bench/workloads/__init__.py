"""Workload definitions; every module here is imported by ``registry.load_all()``.

Add a workload: create ``bench/workloads/<topic>.py`` with a ``Workload(...)`` and one
``@workload.system("shoal" | "dask" | "ray")`` function per system (see
``bench/registry.py``). Nothing else needs registering.
"""
