"""`qserve gateway`: an OpenAI-compatible LLM gateway in front of inference servers.

Routing (by model, alias, weighted least-outstanding, difficulty), retries with backoff and
fallbacks, circuit breakers, per-key rate limits, PII guardrails, an exact-match response
cache, JSONL traces and Prometheus metrics. Any OpenAI-compatible server is a backend.
"""
