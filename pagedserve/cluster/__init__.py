"""Ray Serve deployments, the OpenAI protocol and routes, launch helpers."""
