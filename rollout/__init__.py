"""rollout component (see shared/protocols and docs/)."""
