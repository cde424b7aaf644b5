"""The engine core: the scheduler, the KV cache manager (block pool, requests), the executor and
worker recovery (engine_core.py), and nothing of text. The front end (engine/llm_engine.py)
reaches it through one client interface (client.py) with two implementations: in-process
(inproc_client.py) or in its own process (mp_client.py, running proc.py's busy loop, vLLM v1's
EngineCoreProc). messages.py holds what crosses between the two."""
