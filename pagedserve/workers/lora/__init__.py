"""LoRA adapters on the workers: PEFT folders read and checked (peft_adapter.py), each rank's shard
of an adapter's low-rank weights laid beside the layer it adapts (layer_lora.py), the adapters a
rank holds (manager.py), and the step's rows of each adapter (context.py), which the linear
layers read to add each row's low-rank product in one pass per layer."""
