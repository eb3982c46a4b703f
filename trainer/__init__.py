"""trainer component (see docs/protocols and docs/)."""
