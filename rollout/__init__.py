"""rollout component (see docs/protocols and docs/)."""
