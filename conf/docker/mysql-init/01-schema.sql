-- Reference tables of the docker-compose stack. The MySQL image runs this file once, on an empty
-- data volume, inside the database named by MYSQL_DATABASE (refdata). Same tables as the demo seed
-- (demo/seed.py).

CREATE TABLE models (
  model_id    VARCHAR(16)  NOT NULL PRIMARY KEY,
  model_name  VARCHAR(64)  NOT NULL,
  vendor      VARCHAR(64)  NOT NULL,
  max_temp    DECIMAL(5,1),
  -- the refresher's incremental cursor: every write moves it, on the database's own clock
  last_update DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6),
  KEY models_last_update (last_update)
);

CREATE TABLE devices (
  device_id    VARCHAR(32) NOT NULL PRIMARY KEY,
  model_id     VARCHAR(16) NOT NULL,
  site_id      VARCHAR(16) NOT NULL,
  owner        VARCHAR(32),
  installed_on DATE
);
