"""Training a value-head PRM on a preset's own rollouts (at the edge, like toy/: it imports bench, rescue
and prm; nothing in the core imports it). `kvrescue-local prm train | eval` runs it."""
