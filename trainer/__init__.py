"""trainer component (see shared/protocols and docs/)."""
