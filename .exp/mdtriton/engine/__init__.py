"""Multi-device transformer engines: manifest, parallel plan, communicator, layers, attention, loading and serving."""
