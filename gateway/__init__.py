"""gateway component (see docs/protocols and docs/)."""
