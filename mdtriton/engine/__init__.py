"""Multi-device transformer engines: manifest, parallel plan, communicator, layers, architectures."""
