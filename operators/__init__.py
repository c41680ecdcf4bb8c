"""Ray Data and Spark front ends over one shared row contract."""
