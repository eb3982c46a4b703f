"""gateway component (see shared/protocols and docs/)."""
