"""The driver side: requests, scheduler, KV block manager, detokenizer, LLM."""
