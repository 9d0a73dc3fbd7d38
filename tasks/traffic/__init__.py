"""traffic: route the router's weights to model versions.

``interface.py`` holds the router contract and the route model; one file per router backend
(``haproxy.py`` locally). ``shift.py`` decides weights (first version, red-black, versioned).
"""

from tasks.traffic.interface import ModelRoute, Router, Server, routes_from_registry

__all__ = ["ModelRoute", "Router", "Server", "routes_from_registry"]
