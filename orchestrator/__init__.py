"""orchestrator component (see shared/protocols and docs/)."""
