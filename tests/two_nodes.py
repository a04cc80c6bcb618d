"""A real two-node Ray on this machine (``ray.cluster_utils.Cluster``: a head and a second
node, one CPU each), connected, and shut down after. Losing the second node is
``cluster.remove_node(second)``.

Usage::

    with two_node_ray() as (cluster, second):
        run_job(spec, on_progress=lambda m: cluster.remove_node(second) if m["step"] == 100 else None)
"""

from __future__ import annotations

from contextlib import contextmanager

# A removed node is found dead after its health checks fail: a check a second, three misses
# (Ray's defaults wait 15 s), so that a test's restart does not wait on the detection.
HEALTH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


@contextmanager
def two_node_ray():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": HEALTH})
    try:
        second = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        yield cluster, second
    finally:
        ray.shutdown()
        cluster.shutdown()
