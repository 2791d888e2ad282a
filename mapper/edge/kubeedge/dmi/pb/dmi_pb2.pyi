from google.protobuf import any_pb2 as _any_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MapperRegisterRequest(_message.Message):
    __slots__ = ("withData", "mapper")
    WITHDATA_FIELD_NUMBER: _ClassVar[int]
    MAPPER_FIELD_NUMBER: _ClassVar[int]
    withData: bool
    mapper: MapperInfo
    def __init__(self, withData: _Optional[bool] = ..., mapper: _Optional[_Union[MapperInfo, _Mapping]] = ...) -> None: ...

class MapperRegisterResponse(_message.Message):
    __slots__ = ("modelList", "deviceList")
    MODELLIST_FIELD_NUMBER: _ClassVar[int]
    DEVICELIST_FIELD_NUMBER: _ClassVar[int]
    modelList: _containers.RepeatedCompositeFieldContainer[DeviceModel]
    deviceList: _containers.RepeatedCompositeFieldContainer[Device]
    def __init__(self, modelList: _Optional[_Iterable[_Union[DeviceModel, _Mapping]]] = ..., deviceList: _Optional[_Iterable[_Union[Device, _Mapping]]] = ...) -> None: ...

class MapperInfo(_message.Message):
    __slots__ = ("name", "version", "api_version", "protocol", "address", "state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    api_version: str
    protocol: str
    address: bytes
    state: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., api_version: _Optional[str] = ..., protocol: _Optional[str] = ..., address: _Optional[bytes] = ..., state: _Optional[str] = ...) -> None: ...

class ReportDeviceStatusRequest(_message.Message):
    __slots__ = ("deviceName", "reportedDevice", "deviceNamespace")
    DEVICENAME_FIELD_NUMBER: _ClassVar[int]
    REPORTEDDEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICENAMESPACE_FIELD_NUMBER: _ClassVar[int]
    deviceName: str
    reportedDevice: DeviceStatus
    deviceNamespace: str
    def __init__(self, deviceName: _Optional[str] = ..., reportedDevice: _Optional[_Union[DeviceStatus, _Mapping]] = ..., deviceNamespace: _Optional[str] = ...) -> None: ...

class ReportDeviceStatusResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportDeviceStatesRequest(_message.Message):
    __slots__ = ("deviceName", "deviceNamespace", "state")
    DEVICENAME_FIELD_NUMBER: _ClassVar[int]
    DEVICENAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    deviceName: str
    deviceNamespace: str
    state: str
    def __init__(self, deviceName: _Optional[str] = ..., deviceNamespace: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class ReportDeviceStatesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterDeviceRequest(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: Device
    def __init__(self, device: _Optional[_Union[Device, _Mapping]] = ...) -> None: ...

class RegisterDeviceResponse(_message.Message):
    __slots__ = ("deviceName", "deviceNamespace")
    DEVICENAME_FIELD_NUMBER: _ClassVar[int]
    DEVICENAMESPACE_FIELD_NUMBER: _ClassVar[int]
    deviceName: str
    deviceNamespace: str
    def __init__(self, deviceName: _Optional[str] = ..., deviceNamespace: _Optional[str] = ...) -> None: ...

class RemoveDeviceRequest(_message.Message):
    __slots__ = ("deviceName", "deviceNamespace")
    DEVICENAME_FIELD_NUMBER: _ClassVar[int]
    DEVICENAMESPACE_FIELD_NUMBER: _ClassVar[int]
    deviceName: str
    deviceNamespace: str
    def __init__(self, deviceName: _Optional[str] = ..., deviceNamespace: _Optional[str] = ...) -> None: ...

class RemoveDeviceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateDeviceRequest(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: Device
    def __init__(self, device: _Optional[_Union[Device, _Mapping]] = ...) -> None: ...

class UpdateDeviceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateDeviceModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: DeviceModel
    def __init__(self, model: _Optional[_Union[DeviceModel, _Mapping]] = ...) -> None: ...

class CreateDeviceModelResponse(_message.Message):
    __slots__ = ("deviceModelName", "deviceModelNamespace")
    DEVICEMODELNAME_FIELD_NUMBER: _ClassVar[int]
    DEVICEMODELNAMESPACE_FIELD_NUMBER: _ClassVar[int]
    deviceModelName: str
    deviceModelNamespace: str
    def __init__(self, deviceModelName: _Optional[str] = ..., deviceModelNamespace: _Optional[str] = ...) -> None: ...

class RemoveDeviceModelRequest(_message.Message):
    __slots__ = ("modelName", "modelNamespace")
    MODELNAME_FIELD_NUMBER: _ClassVar[int]
    MODELNAMESPACE_FIELD_NUMBER: _ClassVar[int]
    modelName: str
    modelNamespace: str
    def __init__(self, modelName: _Optional[str] = ..., modelNamespace: _Optional[str] = ...) -> None: ...

class RemoveDeviceModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateDeviceModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: DeviceModel
    def __init__(self, model: _Optional[_Union[DeviceModel, _Mapping]] = ...) -> None: ...

class UpdateDeviceModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDeviceRequest(_message.Message):
    __slots__ = ("deviceName", "deviceNamespace")
    DEVICENAME_FIELD_NUMBER: _ClassVar[int]
    DEVICENAMESPACE_FIELD_NUMBER: _ClassVar[int]
    deviceName: str
    deviceNamespace: str
    def __init__(self, deviceName: _Optional[str] = ..., deviceNamespace: _Optional[str] = ...) -> None: ...

class GetDeviceResponse(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: Device
    def __init__(self, device: _Optional[_Union[Device, _Mapping]] = ...) -> None: ...

class DeviceModel(_message.Message):
    __slots__ = ("name", "spec", "namespace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: DeviceModelSpec
    namespace: str
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[DeviceModelSpec, _Mapping]] = ..., namespace: _Optional[str] = ...) -> None: ...

class DeviceModelSpec(_message.Message):
    __slots__ = ("properties", "commands")
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    properties: _containers.RepeatedCompositeFieldContainer[ModelProperty]
    commands: _containers.RepeatedCompositeFieldContainer[DeviceCommand]
    def __init__(self, properties: _Optional[_Iterable[_Union[ModelProperty, _Mapping]]] = ..., commands: _Optional[_Iterable[_Union[DeviceCommand, _Mapping]]] = ...) -> None: ...

class ModelProperty(_message.Message):
    __slots__ = ("name", "description", "type", "accessMode", "minimum", "maximum", "unit")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    ACCESSMODE_FIELD_NUMBER: _ClassVar[int]
    MINIMUM_FIELD_NUMBER: _ClassVar[int]
    MAXIMUM_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    type: str
    accessMode: str
    minimum: str
    maximum: str
    unit: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., type: _Optional[str] = ..., accessMode: _Optional[str] = ..., minimum: _Optional[str] = ..., maximum: _Optional[str] = ..., unit: _Optional[str] = ...) -> None: ...

class DeviceCommand(_message.Message):
    __slots__ = ("name", "url", "method", "status_code", "parameters", "response")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    name: str
    url: str
    method: str
    status_code: _containers.RepeatedScalarFieldContainer[str]
    parameters: _containers.RepeatedScalarFieldContainer[str]
    response: bytes
    def __init__(self, name: _Optional[str] = ..., url: _Optional[str] = ..., method: _Optional[str] = ..., status_code: _Optional[_Iterable[str]] = ..., parameters: _Optional[_Iterable[str]] = ..., response: _Optional[bytes] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("name", "spec", "status", "namespace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: DeviceSpec
    status: DeviceStatus
    namespace: str
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[DeviceSpec, _Mapping]] = ..., status: _Optional[_Union[DeviceStatus, _Mapping]] = ..., namespace: _Optional[str] = ...) -> None: ...

class DeviceSpec(_message.Message):
    __slots__ = ("deviceModelReference", "protocol", "properties", "methods")
    DEVICEMODELREFERENCE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    deviceModelReference: str
    protocol: ProtocolConfig
    properties: _containers.RepeatedCompositeFieldContainer[DeviceProperty]
    methods: _containers.RepeatedCompositeFieldContainer[DeviceMethod]
    def __init__(self, deviceModelReference: _Optional[str] = ..., protocol: _Optional[_Union[ProtocolConfig, _Mapping]] = ..., properties: _Optional[_Iterable[_Union[DeviceProperty, _Mapping]]] = ..., methods: _Optional[_Iterable[_Union[DeviceMethod, _Mapping]]] = ...) -> None: ...

class DeviceMethod(_message.Message):
    __slots__ = ("name", "description", "propertyNames")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PROPERTYNAMES_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    propertyNames: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., propertyNames: _Optional[_Iterable[str]] = ...) -> None: ...

class DeviceProperty(_message.Message):
    __slots__ = ("name", "desired", "visitors", "reportCycle", "collectCycle", "reportToCloud", "pushMethod")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    VISITORS_FIELD_NUMBER: _ClassVar[int]
    REPORTCYCLE_FIELD_NUMBER: _ClassVar[int]
    COLLECTCYCLE_FIELD_NUMBER: _ClassVar[int]
    REPORTTOCLOUD_FIELD_NUMBER: _ClassVar[int]
    PUSHMETHOD_FIELD_NUMBER: _ClassVar[int]
    name: str
    desired: TwinProperty
    visitors: VisitorConfig
    reportCycle: int
    collectCycle: int
    reportToCloud: bool
    pushMethod: PushMethod
    def __init__(self, name: _Optional[str] = ..., desired: _Optional[_Union[TwinProperty, _Mapping]] = ..., visitors: _Optional[_Union[VisitorConfig, _Mapping]] = ..., reportCycle: _Optional[int] = ..., collectCycle: _Optional[int] = ..., reportToCloud: _Optional[bool] = ..., pushMethod: _Optional[_Union[PushMethod, _Mapping]] = ...) -> None: ...

class ProtocolConfig(_message.Message):
    __slots__ = ("protocolName", "configData")
    PROTOCOLNAME_FIELD_NUMBER: _ClassVar[int]
    CONFIGDATA_FIELD_NUMBER: _ClassVar[int]
    protocolName: str
    configData: CustomizedValue
    def __init__(self, protocolName: _Optional[str] = ..., configData: _Optional[_Union[CustomizedValue, _Mapping]] = ...) -> None: ...

class VisitorConfig(_message.Message):
    __slots__ = ("protocolName", "configData")
    PROTOCOLNAME_FIELD_NUMBER: _ClassVar[int]
    CONFIGDATA_FIELD_NUMBER: _ClassVar[int]
    protocolName: str
    configData: CustomizedValue
    def __init__(self, protocolName: _Optional[str] = ..., configData: _Optional[_Union[CustomizedValue, _Mapping]] = ...) -> None: ...

class CustomizedValue(_message.Message):
    __slots__ = ("data",)
    class DataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _any_pb2.Any
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: _containers.MessageMap[str, _any_pb2.Any]
    def __init__(self, data: _Optional[_Mapping[str, _any_pb2.Any]] = ...) -> None: ...

class DeviceStatus(_message.Message):
    __slots__ = ("twins", "reportToCloud", "reportCycle")
    TWINS_FIELD_NUMBER: _ClassVar[int]
    REPORTTOCLOUD_FIELD_NUMBER: _ClassVar[int]
    REPORTCYCLE_FIELD_NUMBER: _ClassVar[int]
    twins: _containers.RepeatedCompositeFieldContainer[Twin]
    reportToCloud: bool
    reportCycle: int
    def __init__(self, twins: _Optional[_Iterable[_Union[Twin, _Mapping]]] = ..., reportToCloud: _Optional[bool] = ..., reportCycle: _Optional[int] = ...) -> None: ...

class Twin(_message.Message):
    __slots__ = ("propertyName", "observedDesired", "reported")
    PROPERTYNAME_FIELD_NUMBER: _ClassVar[int]
    OBSERVEDDESIRED_FIELD_NUMBER: _ClassVar[int]
    REPORTED_FIELD_NUMBER: _ClassVar[int]
    propertyName: str
    observedDesired: TwinProperty
    reported: TwinProperty
    def __init__(self, propertyName: _Optional[str] = ..., observedDesired: _Optional[_Union[TwinProperty, _Mapping]] = ..., reported: _Optional[_Union[TwinProperty, _Mapping]] = ...) -> None: ...

class TwinProperty(_message.Message):
    __slots__ = ("value", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VALUE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    value: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, value: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PushMethod(_message.Message):
    __slots__ = ("http", "mqtt", "dbMethod", "otel", "anomalyDetection")
    HTTP_FIELD_NUMBER: _ClassVar[int]
    MQTT_FIELD_NUMBER: _ClassVar[int]
    DBMETHOD_FIELD_NUMBER: _ClassVar[int]
    OTEL_FIELD_NUMBER: _ClassVar[int]
    ANOMALYDETECTION_FIELD_NUMBER: _ClassVar[int]
    http: PushMethodHTTP
    mqtt: PushMethodMQTT
    dbMethod: DBMethod
    otel: PushMethodOTEL
    anomalyDetection: AnomalyDetection
    def __init__(self, http: _Optional[_Union[PushMethodHTTP, _Mapping]] = ..., mqtt: _Optional[_Union[PushMethodMQTT, _Mapping]] = ..., dbMethod: _Optional[_Union[DBMethod, _Mapping]] = ..., otel: _Optional[_Union[PushMethodOTEL, _Mapping]] = ..., anomalyDetection: _Optional[_Union[AnomalyDetection, _Mapping]] = ...) -> None: ...

class PushMethodHTTP(_message.Message):
    __slots__ = ("hostname", "port", "requestpath", "timeout")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    REQUESTPATH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    port: int
    requestpath: str
    timeout: int
    def __init__(self, hostname: _Optional[str] = ..., port: _Optional[int] = ..., requestpath: _Optional[str] = ..., timeout: _Optional[int] = ...) -> None: ...

class PushMethodMQTT(_message.Message):
    __slots__ = ("address", "topic", "qos", "retained")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    address: str
    topic: str
    qos: int
    retained: bool
    def __init__(self, address: _Optional[str] = ..., topic: _Optional[str] = ..., qos: _Optional[int] = ..., retained: _Optional[bool] = ...) -> None: ...

class PushMethodOTEL(_message.Message):
    __slots__ = ("endpointURL",)
    ENDPOINTURL_FIELD_NUMBER: _ClassVar[int]
    endpointURL: str
    def __init__(self, endpointURL: _Optional[str] = ...) -> None: ...

class AnomalyDetection(_message.Message):
    __slots__ = ("data",)
    class DataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _any_pb2.Any
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: _containers.MessageMap[str, _any_pb2.Any]
    def __init__(self, data: _Optional[_Mapping[str, _any_pb2.Any]] = ...) -> None: ...

class DBMethod(_message.Message):
    __slots__ = ("influxdb2", "redis", "tdengine", "mysql")
    INFLUXDB2_FIELD_NUMBER: _ClassVar[int]
    REDIS_FIELD_NUMBER: _ClassVar[int]
    TDENGINE_FIELD_NUMBER: _ClassVar[int]
    MYSQL_FIELD_NUMBER: _ClassVar[int]
    influxdb2: DBMethodInfluxdb2
    redis: DBMethodRedis
    tdengine: DBMethodTDEngine
    mysql: DBMethodMySQL
    def __init__(self, influxdb2: _Optional[_Union[DBMethodInfluxdb2, _Mapping]] = ..., redis: _Optional[_Union[DBMethodRedis, _Mapping]] = ..., tdengine: _Optional[_Union[DBMethodTDEngine, _Mapping]] = ..., mysql: _Optional[_Union[DBMethodMySQL, _Mapping]] = ...) -> None: ...

class DBMethodInfluxdb2(_message.Message):
    __slots__ = ("influxdb2ClientConfig", "influxdb2DataConfig")
    INFLUXDB2CLIENTCONFIG_FIELD_NUMBER: _ClassVar[int]
    INFLUXDB2DATACONFIG_FIELD_NUMBER: _ClassVar[int]
    influxdb2ClientConfig: Influxdb2ClientConfig
    influxdb2DataConfig: Influxdb2DataConfig
    def __init__(self, influxdb2ClientConfig: _Optional[_Union[Influxdb2ClientConfig, _Mapping]] = ..., influxdb2DataConfig: _Optional[_Union[Influxdb2DataConfig, _Mapping]] = ...) -> None: ...

class Influxdb2ClientConfig(_message.Message):
    __slots__ = ("url", "org", "bucket")
    URL_FIELD_NUMBER: _ClassVar[int]
    ORG_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    url: str
    org: str
    bucket: str
    def __init__(self, url: _Optional[str] = ..., org: _Optional[str] = ..., bucket: _Optional[str] = ...) -> None: ...

class Influxdb2DataConfig(_message.Message):
    __slots__ = ("measurement", "tag", "fieldKey")
    class TagEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MEASUREMENT_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    FIELDKEY_FIELD_NUMBER: _ClassVar[int]
    measurement: str
    tag: _containers.ScalarMap[str, str]
    fieldKey: str
    def __init__(self, measurement: _Optional[str] = ..., tag: _Optional[_Mapping[str, str]] = ..., fieldKey: _Optional[str] = ...) -> None: ...

class DBMethodRedis(_message.Message):
    __slots__ = ("redisClientConfig",)
    REDISCLIENTCONFIG_FIELD_NUMBER: _ClassVar[int]
    redisClientConfig: RedisClientConfig
    def __init__(self, redisClientConfig: _Optional[_Union[RedisClientConfig, _Mapping]] = ...) -> None: ...

class RedisClientConfig(_message.Message):
    __slots__ = ("addr", "db", "poolsize", "minIdleConns")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    DB_FIELD_NUMBER: _ClassVar[int]
    POOLSIZE_FIELD_NUMBER: _ClassVar[int]
    MINIDLECONNS_FIELD_NUMBER: _ClassVar[int]
    addr: str
    db: int
    poolsize: int
    minIdleConns: int
    def __init__(self, addr: _Optional[str] = ..., db: _Optional[int] = ..., poolsize: _Optional[int] = ..., minIdleConns: _Optional[int] = ...) -> None: ...

class DBMethodTDEngine(_message.Message):
    __slots__ = ("tdEngineClientConfig",)
    TDENGINECLIENTCONFIG_FIELD_NUMBER: _ClassVar[int]
    tdEngineClientConfig: TDEngineClientConfig
    def __init__(self, tdEngineClientConfig: _Optional[_Union[TDEngineClientConfig, _Mapping]] = ...) -> None: ...

class TDEngineClientConfig(_message.Message):
    __slots__ = ("addr", "dbname")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    DBNAME_FIELD_NUMBER: _ClassVar[int]
    addr: str
    dbname: str
    def __init__(self, addr: _Optional[str] = ..., dbname: _Optional[str] = ...) -> None: ...

class DBMethodMySQL(_message.Message):
    __slots__ = ("mysqlClientConfig",)
    MYSQLCLIENTCONFIG_FIELD_NUMBER: _ClassVar[int]
    mysqlClientConfig: MySQLClientConfig
    def __init__(self, mysqlClientConfig: _Optional[_Union[MySQLClientConfig, _Mapping]] = ...) -> None: ...

class MySQLClientConfig(_message.Message):
    __slots__ = ("addr", "database", "userName")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    DATABASE_FIELD_NUMBER: _ClassVar[int]
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    addr: str
    database: str
    userName: str
    def __init__(self, addr: _Optional[str] = ..., database: _Optional[str] = ..., userName: _Optional[str] = ...) -> None: ...

class DBMethodOTEL(_message.Message):
    __slots__ = ("otelExporterConfig",)
    OTELEXPORTERCONFIG_FIELD_NUMBER: _ClassVar[int]
    otelExporterConfig: OTELExporterConfig
    def __init__(self, otelExporterConfig: _Optional[_Union[OTELExporterConfig, _Mapping]] = ...) -> None: ...

class OTELExporterConfig(_message.Message):
    __slots__ = ("endpointURL",)
    ENDPOINTURL_FIELD_NUMBER: _ClassVar[int]
    endpointURL: str
    def __init__(self, endpointURL: _Optional[str] = ...) -> None: ...
