"""The search beyond one process: a region's search as a job (``jobs``), a cluster worker that owns one device
(``workers``) and the Ray pool that fans a model's distinct regions out over such workers (``pool``)."""
