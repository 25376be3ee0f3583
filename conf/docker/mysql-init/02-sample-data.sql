-- Sample reference data: 12 models and 5000 devices d-1..d-5000, the ids the simulator sends.
-- Device d-N has model m-((7N mod 12)+1) and site s-((13N mod 20)+1), as in demo/seed.py.
-- Portable SQL (MySQL 8 and MariaDB): numbers from a cross join of digits, no recursive CTE limits.

INSERT INTO models (model_id, model_name, vendor, max_temp) VALUES
  ('m-1', 'Thermo T100', 'Acme', 60.0),
  ('m-2', 'Thermo T200', 'Acme', 70.0),
  ('m-3', 'Sense S1', 'Initech', 55.5),
  ('m-4', 'Sense S2', 'Initech', 65.5),
  ('m-5', 'Probe P7', 'Globex', 80.0),
  ('m-6', 'Probe P9', 'Globex', 85.0),
  ('m-7', 'Node N3', 'Umbrella', 50.0),
  ('m-8', 'Node N4', 'Umbrella', 52.5),
  ('m-9', 'Tag G1', 'Hooli', 45.0),
  ('m-10', 'Tag G2', 'Hooli', 47.5),
  ('m-11', 'Meter M5', 'Stark', 90.0),
  ('m-12', 'Meter M6', 'Stark', 95.0);

INSERT INTO devices (device_id, model_id, site_id, owner, installed_on)
SELECT CONCAT('d-', n),
       CONCAT('m-', MOD(n * 7, 12) + 1),
       CONCAT('s-', MOD(n * 13, 20) + 1),
       ELT(MOD(n, 6) + 1, 'ops', 'facilities', 'research', 'logistics', 'retail', 'energy'),
       DATE_ADD('2023-01-01', INTERVAL MOD(n, 700) DAY)
FROM (
  SELECT 1 + a.d + 10 * b.d + 100 * c.d + 1000 * e.d AS n
  FROM (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
        UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) a
  CROSS JOIN (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
        UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) b
  CROSS JOIN (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
        UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) c
  CROSS JOIN (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4) e
) numbers;
