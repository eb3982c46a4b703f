"""The orchestrator: env registry, heartbeats, a weighted scheduler of GRPO groups, retries, and
durable run state in Redis (docs/orchestrator.md)."""
