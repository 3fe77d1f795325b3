"""Multi-device and multi-host: meshes and sharding, process groups, lockstep dispatch."""
