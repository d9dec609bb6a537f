"""What the routers learned: `groups` observes the routing of a forward pass (`record_routing`,
`group_assignments`), `report` turns it into per-group statistics, `page` renders them as HTML and `chart` as PNG.
"""
