"""``superinfer bench``: the serving benchmark client (``cli``), its gRPC and OpenAI HTTP
clients (``clients``), closed-loop multi-turn replay (``multiturn``), in-process engine
replay (``replay``) and plots (``plots``). Workloads and metrics come from
``superinfer_jax.sim`` (shared with the simulator)."""
