"""envs component (see shared/protocols and docs/)."""
