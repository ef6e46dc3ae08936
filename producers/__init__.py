"""The SDK internal services use to publish requests onto the bus and read their token
streams back, with no HTTP hop::

    from tokenbus.producers import TokenbusClient
"""

from tokenbus.producers.client import Submission, TokenbusClient, new_request_id
from tokenbus.producers.moderated import InputModerator
from tokenbus.producers.placement import Placement, PrefixIndex, PrefixRouter
from tokenbus.producers.publisher import RequestPublisher, UnknownRoute

__all__ = ["InputModerator", "Placement", "PrefixIndex", "PrefixRouter", "RequestPublisher", "Submission",
           "TokenbusClient", "UnknownRoute", "new_request_id"]
