"""DLPlacer: MILP placement of an op graph on the devices of the model axis."""
