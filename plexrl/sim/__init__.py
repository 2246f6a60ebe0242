"""Cluster-scale what-if studies on the real planner: cost models (`costs`), deployments as configurations
(`deploy`), trace replay (`trace`) and the report of `plexrl simulate` (`report`). Torch-free and Dask-free;
the executor is `plexrl.runtime.sim.SimExecutor`. See docs/simulator.md."""
