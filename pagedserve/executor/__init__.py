"""The executors: the engine's only way to the workers (`execute_model(SchedulerOutput) ->
ModelRunnerOutput`), in-process or over Ray actors. Below the engine, above the workers."""
