"""Wire types of the HTTP contracts between components (docs/protocols/*.md), one module per
service. They live in the kernel because both sides of each contract use them (a server and the
clients in other components), and components never import each other."""
