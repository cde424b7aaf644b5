"""The engine core in its own process (vLLM v1's EngineCoreProc): the scheduler and the executor
run in a busy loop in a child process while the front end (AsyncLLM, LLM) tokenizes, detokenizes,
applies stop strings and streams. See messages.py for what crosses between the two."""
